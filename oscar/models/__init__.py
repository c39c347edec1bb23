"""Model registry, adapters and loading (GGUF packages offline, Hugging Face ids online)."""
