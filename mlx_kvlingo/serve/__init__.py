"""The OpenAI-compatible server: conversations behind stateless requests
(``conversations``), one worker thread for all MLX work (``engine``) and the
HTTP layer (``server``)."""
