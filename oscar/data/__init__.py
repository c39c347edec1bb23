"""Text corpora for calibration and perplexity, read from locally installed packages or files."""
