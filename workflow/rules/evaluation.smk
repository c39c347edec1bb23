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
