# SGLang serving on the GPU (`python -m oscar gpu serving`, the serving table of benchmarks/README.md: SGLang's
# one-batch benchmark with the BF16 backends and the oscar plugin; SGLang installed, or the offline bundle through
# benchmarks/gpu.sh); on a host without a GPU the target only explains that it was skipped. The committed H200 run
# lives in reports/serving/.

SERVING_MESSAGE = (
    "reproduce_serving: SGLang decode/prefill rows written to results/serving/ (decode.md, decode.csv, decode.png) and MLflow"
    if HAS_GPU
    else "reproduce_serving: SKIPPED, no CUDA GPU on this host (nvidia-smi found none); run it on a GPU host with SGLang "
    "(benchmarks/README.md): snakemake --cores all --resources gpu=1 reproduce_serving "
    "(the H200 run is in reports/serving/)"
)


rule serving_decode:
    output:
        md="results/serving/decode.md",
        csv="results/serving/decode.csv",
    params:
        tracking=lambda wc: gpu_tracking(),
    log:
        "logs/serving_decode/run.log",
    threads: 4
    resources:
        mem_mb=64000,
        runtime=60,
        gpu=1,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar gpu serving out=results/serving {params.tracking} > {log} 2>&1"


rule reproduce_serving:
    localrule: True
    input:
        lambda wc: ["results/serving/decode.md"] if HAS_GPU else [],
    params:
        message=SERVING_MESSAGE,
    log:
        "logs/reproduce_serving/status.log",
    conda:
        "../../envs/oscar.yaml"
    shell:
        "echo {params.message:q} | tee {log}"
