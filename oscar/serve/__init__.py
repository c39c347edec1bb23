"""Serving integrations (SGLang plugin)."""
