# GPU kernel benchmarks (`python -m oscar gpu kernels`, the kernel table of benchmarks/README.md); on a host without a
# GPU the target only explains that it was skipped.


rule bench_kernels:
    output:
        csv=report(
            "reports/{experiment}/kernels.csv",
            caption="../report/kernels.rst",
            category="{experiment}",
            subcategory="kernels",
        ),
    params:
        tracking=lambda wc: gpu_tracking(),
    log:
        "logs/bench_kernels/{experiment}.log",
    benchmark:
        "results/benchmarks/bench_kernels/{experiment}.tsv"
    threads: res("kernels", "threads")
    resources:
        mem_mb=res("kernels", "mem_mb"),
        runtime=res("kernels", "runtime"),
        gpu=res("kernels", "gpu"),
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar gpu kernels out=reports/{wildcards.experiment} name=kernels {params.tracking} > {log} 2>&1"


ruleorder: bench_kernels > report_table
