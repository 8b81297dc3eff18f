"""The `mlx-kvlingo` command (installed as the `mlx_kvlingo_cli` package)."""
