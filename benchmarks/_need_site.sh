# Sourced by the GPU scripts that run Hydra-configured verbs, after PYTHONPATH is set: stops with the way out
# when omegaconf/hydra are not importable (the bare GPU image lacks them; benchmarks/gpu_site.sh builds ./_site).
if ! python3 -c "import omegaconf, hydra" 2>/dev/null; then
  echo "omegaconf/hydra are not importable here: run 'bash benchmarks/gpu_site.sh' where pip works and send" \
       "./_site with the call (carry: [\"_site\"])" >&2
  exit 2
fi
