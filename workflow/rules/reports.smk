# Aggregation, reports and the MLflow mirror, one job each per table.


rule aggregate_table:
    input:
        plan=_check_experiment,
        cells=_table_cells,
    output:
        "results/tables/{experiment}/{table}.csv",
    log:
        "logs/aggregate_table/{experiment}/{table}.log",
    threads: res("report", "threads")
    resources:
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
        gpu=0,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar aggregate --plan {input.plan} --output {output} > {log} 2>&1"


rule report_table:
    input:
        plan=_check_experiment,
        table="results/tables/{experiment}/{table}.csv",
    output:
        csv=report(
            "reports/{experiment}/{table}.csv",
            caption="../report/table.rst",
            category="{experiment}",
            subcategory="{table}",
            labels={"table": "{table}", "format": "CSV"},
        ),
        md="reports/{experiment}/{table}.md",
        tex="reports/{experiment}/{table}.tex",
    params:
        title=lambda wc: table_plan(wc.table).spec.get("title") or wc.table,
        caption=lambda wc: table_plan(wc.table).spec.get("caption") or "",
    log:
        "logs/report_table/{experiment}/{table}.log",
    threads: res("report", "threads")
    resources:
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
        gpu=0,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar report --plan {input.plan} --table {input.table} --output-dir reports/{wildcards.experiment} "
        "--formats csv md tex > {log} 2>&1"


rule figure_table:
    input:
        plan=_check_experiment,
        table="results/tables/{experiment}/{table}.csv",
    output:
        report(
            "reports/{experiment}/{table}.png",
            caption="../report/figure.rst",
            category="{experiment}",
            subcategory="{table}",
            labels={"table": "{table}", "format": "figure"},
        ),
    params:
        title=lambda wc: table_plan(wc.table).spec.get("title") or wc.table,
        caption=lambda wc: table_plan(wc.table).spec.get("caption") or "",
    log:
        "logs/figure_table/{experiment}/{table}.log",
    threads: res("report", "threads")
    resources:
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
        gpu=0,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar report --plan {input.plan} --table {input.table} --output-dir reports/{wildcards.experiment} "
        "--formats png > {log} 2>&1"


rule track_table:
    input:
        plan=_check_experiment,
        cells=_table_cells,
        reports=lambda wc: [p for p in table_targets(wc.table) if p.startswith("reports/")],
    output:
        "results/tracking/{experiment}/{table}.json",
    params:
        tracking=lambda wc: quoted(
            ["--uri", str(PLAN.base.tracking.uri)]
            + (["--experiment-prefix", str(PLAN.base.tracking.experiment)] if PLAN.base.tracking.experiment else [])
        ),
    log:
        "logs/track_table/{experiment}/{table}.log",
    threads: 1
    resources:
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
        gpu=0,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar report --plan {input.plan} --track --track-output {output} {params.tracking} > {log} 2>&1"


rule accuracy_report:
    # Task accuracy by method (experiment=coder): pass@1 / needles with intervals, bits and paired diffs to BF16.
    input:
        cells=lambda wc: [f"{c.result_dir}/result.json" for t in ("humaneval", "niah") for c in table_plan(t).cells],
    output:
        csv="reports/accuracy/humaneval.csv",
        md="reports/accuracy/humaneval.md",
        png="reports/accuracy/humaneval.png",
        niah_csv="reports/accuracy/niah.csv",
        niah_md="reports/accuracy/niah.md",
        niah_png="reports/accuracy/niah.png",
    params:
        model=lambda wc: table_plan("humaneval").cells[0].model,
    log:
        "logs/accuracy_report/accuracy.log",
    threads: res("report", "threads")
    resources:
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
        gpu=0,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar.studies.accuracy --results results --model {params.model} --out-dir reports/accuracy > {log} 2>&1"
