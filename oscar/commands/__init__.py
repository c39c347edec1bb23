"""One module per command-line verb; each exposes `main(argv: list[str]) -> int`."""
