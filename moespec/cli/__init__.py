"""Command-line interface (Typer). Torch is imported lazily inside commands so --help is instant."""
