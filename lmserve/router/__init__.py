"""`lmserve router`: one OpenAI-compatible front for several lmserve replicas (data parallelism), and for
a prefill / decode pair (disaggregation).

    policy.py   which replica takes a request: round-robin, least-load, or prefix (an approximate map of
                the prompt prefixes each replica has seen, SGLang-style, balanced against load)
    app.py      the proxy: forwards the request's bytes, streams the replica's bytes back, health-checks
                the replicas, retries a request elsewhere while nothing was streamed, its own /metrics
    launch.py   `lmserve serve --data-parallel N`: N engine processes and the router in one command
"""
