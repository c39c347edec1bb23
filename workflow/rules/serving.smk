# SGLang serving on the GPU (H200 + the sglang 0.5.17 bundle at .dev/sglang-gpu, README "Serving with SGLang"):
# benchmarks/gpu_serving.sh runs SGLang's one-batch benchmark with the BF16 backends and the oscar plugin; on a host
# without a GPU the target only explains that it was skipped. The committed H200 run lives in reports/serving/.

SERVING_MESSAGE = (
    "reproduce_serving: SGLang decode/prefill rows written to results/serving/ (decode.md, decode.csv, decode.png) and MLflow"
    if HAS_GPU
    else "reproduce_serving: SKIPPED, no CUDA GPU on this host (nvidia-smi found none); run it on a GPU host with the "
    "sglang 0.5.17 bundle at .dev/sglang-gpu: snakemake --cores all --resources gpu=1 reproduce_serving "
    "(the H200 run is in reports/serving/)"
)


rule serving_decode:
    output:
        md="results/serving/decode.md",
        csv="results/serving/decode.csv",
    params:
        tracking=lambda wc: quoted(["--mlflow-uri", str(PLAN.base.tracking.uri)]) if PLAN.base.tracking.enabled else "",
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
        "OUT=results/serving bash benchmarks/gpu_serving.sh > {log} 2>&1 && "
        "$OSCAR_PYTHON benchmarks/serving_report.py results/serving/serving_rows.jsonl --out results/serving "
        "{params.tracking} >> {log} 2>&1"


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
