# End-to-end decode throughput (GPU only): `python -m oscar gpu throughput` (the throughput table of
# benchmarks/README.md); on a host without a GPU the target only explains that it was skipped. The committed H200
# run lives in reports/throughput/.

THROUGHPUT_MESSAGE = (
    "reproduce_throughput: decode throughput written to results/throughput/ (throughput.md, CSVs, PNG) and MLflow"
    if HAS_GPU
    else "reproduce_throughput: SKIPPED, no CUDA GPU on this host (nvidia-smi found none); run it on a GPU host: "
    "snakemake --cores all --resources gpu=1 reproduce_throughput (the H200 run is in reports/throughput/)"
)


rule profile_throughput:
    output:
        md=report(
            "results/throughput/throughput.md",
            caption="../report/throughput.rst",
            category="throughput",
        ),
        grid="results/throughput/grid.csv",
    params:
        tracking=lambda wc: gpu_tracking(),
    log:
        "logs/profile_throughput/profile.log",
    benchmark:
        "results/benchmarks/profile_throughput/profile.tsv"
    threads: 4
    resources:
        mem_mb=64000,
        runtime=90,
        gpu=1,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar gpu throughput out=results/throughput {params.tracking} > {log} 2>&1"


rule reproduce_throughput:
    localrule: True
    input:
        lambda wc: ["results/throughput/throughput.md"] if HAS_GPU else [],
    params:
        message=THROUGHPUT_MESSAGE,
    log:
        "logs/reproduce_throughput/status.log",
    conda:
        "../../envs/oscar.yaml"
    shell:
        "echo {params.message:q} | tee {log}"
