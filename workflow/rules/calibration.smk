# Calibration: activation statistics per (model, calibration data), then each method's artifact.


rule dump:
    input:
        config="results/config/stats/{model}/{calibration}.yaml",
    output:
        stats="results/stats/{model}/{calibration}/stats.safetensors",
        meta="results/stats/{model}/{calibration}/stats.json",
    params:
        overrides=lambda wc: quoted(stats_of(wc).overrides),
        outdir=lambda wc, output: str(Path(output.stats).parent),
    log:
        "logs/dump/{model}/{calibration}.log",
    benchmark:
        "results/benchmarks/dump/{model}/{calibration}.tsv"
    threads: res("dump", "threads")
    resources:
        mem_mb=res("dump", "mem_mb"),
        runtime=res("dump", "runtime"),
        gpu=res("dump", "gpu"),
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar dump {params.overrides} output={params.outdir} > {log} 2>&1"


rule rotations:
    input:
        config="results/config/calibration/{model}/{method}.yaml",
        stats=lambda wc: f"{calibration_of(wc).stats_dir}/stats.safetensors",
    output:
        rotations="results/rotations/{model}/{method}/rotations.safetensors",
        meta="results/rotations/{model}/{method}/meta.json",
    params:
        overrides=lambda wc: quoted(calibration_of(wc).overrides),
        outdir=lambda wc, output: str(Path(output.rotations).parent),
    log:
        "logs/rotations/{model}/{method}.log",
    benchmark:
        "results/benchmarks/rotations/{model}/{method}.tsv"
    threads: res("calibrate", "threads")
    resources:
        mem_mb=res("calibrate", "mem_mb"),
        runtime=res("calibrate", "runtime"),
        gpu=0,
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar rotations {params.overrides} output={params.outdir} > {log} 2>&1"


rule clip:
    input:
        config="results/config/calibration/{model}/{method}.yaml",
        stats=lambda wc: f"{calibration_of(wc).stats_dir}/stats.safetensors",
        rotations="results/rotations/{model}/{method}/rotations.safetensors",
    output:
        rotations="results/calibration/{model}/{method}/rotations.safetensors",
        meta="results/calibration/{model}/{method}/meta.json",
    params:
        overrides=lambda wc: quoted(calibration_of(wc).overrides),
        outdir=lambda wc, output: str(Path(output.rotations).parent),
    log:
        "logs/clip/{model}/{method}.log",
    benchmark:
        "results/benchmarks/clip/{model}/{method}.tsv"
    threads: res("calibrate", "threads")
    resources:
        mem_mb=res("calibrate", "mem_mb"),
        runtime=res("calibrate", "runtime"),
        gpu=res("calibrate", "gpu"),
    conda:
        "../../envs/oscar.yaml"
    shell:
        "$OSCAR_PYTHON -m oscar clip {params.overrides} output={params.outdir} > {log} 2>&1"
