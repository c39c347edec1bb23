# Evaluation cells: one job per (model, method[+variant], benchmark, seed) and per fidelity corpus.


rule eval_cell:
    input:
        config="results/config/eval/{model}/{method}/{benchmark}/seed{seed}.yaml",
        artifact=lambda wc: _artifact_input(eval_cell(wc)),
    output:
        result="results/eval/{model}/{method}/{benchmark}/seed{seed}/result.json",
        records="results/eval/{model}/{method}/{benchmark}/seed{seed}/items.jsonl",
    params:
        overrides=lambda wc: quoted(eval_cell(wc).flags + eval_cell(wc).overrides),
        outdir=lambda wc, output: str(Path(output.result).parent),
    log:
        "logs/eval_cell/{model}/{method}/{benchmark}/seed{seed}.log",
    benchmark:
        "results/benchmarks/eval_cell/{model}/{method}/{benchmark}/seed{seed}.tsv"
    threads: res("eval", "threads")
    resources:
        mem_mb=res("eval", "mem_mb"),
        runtime=res("eval", "runtime"),
        gpu=res("eval", "gpu"),
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar eval threads={threads} {params.overrides} output={params.outdir} > {log} 2>&1"



# Needle cells with `benchmark.extra.shared_prefill`: one job per (table, model, benchmark, seed) runs every
# method's cell with one BF16 prefill per haystack (`oscar eval-shared`); eval_cell does not make these cells.
for _key, _cells in PLAN.shared_prefill_groups().items():
    _name = "eval_shared_" + "".join(c if c.isalnum() else "_" for c in _key)

    rule:
        name:
            _name
        input:
            configs=[c.config_path for c in _cells],
            artifacts=[f for c in _cells for f in _artifact_input(c)],
        output:
            results=[f"{c.result_dir}/result.json" for c in _cells],
            records=[f"{c.result_dir}/items.jsonl" for c in _cells],
        log:
            f"logs/eval_shared/{_key}.log",
        benchmark:
            f"results/benchmarks/eval_shared/{_key}.tsv"
        threads: res("eval", "threads")
        resources:
            mem_mb=res("eval", "mem_mb"),
            runtime=res("eval", "runtime"),
            gpu=res("eval", "gpu"),
        conda:
            "../../envs/oscar.yaml"
        params:
            cells=" -- ".join(f"{quoted(c.flags + c.overrides)} output={c.result_dir}" for c in _cells),
        shell:
            "$OSCAR_PYTHON -m oscar eval-shared threads={threads} {params.cells} > {log} 2>&1"

    workflow.ruleorder(_name, "eval_cell")

rule fidelity_cell:
    input:
        config="results/config/fidelity/{model}/{method}/{corpus}.yaml",
        artifact=lambda wc: _artifact_input(fidelity_cell(wc)),
    output:
        result="results/fidelity/{model}/{method}/{corpus}/result.json",
        per_layer="results/fidelity/{model}/{method}/{corpus}/per_layer.csv",
    params:
        overrides=lambda wc: quoted(fidelity_cell(wc).flags + fidelity_cell(wc).overrides),
        outdir=lambda wc, output: str(Path(output.result).parent),
    log:
        "logs/fidelity_cell/{model}/{method}/{corpus}.log",
    benchmark:
        "results/benchmarks/fidelity_cell/{model}/{method}/{corpus}.tsv"
    threads: res("fidelity", "threads")
    resources:
        mem_mb=res("fidelity", "mem_mb"),
        runtime=res("fidelity", "runtime"),
        gpu=res("fidelity", "gpu"),
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar fidelity threads={threads} {params.overrides} output={params.outdir} > {log} 2>&1"
