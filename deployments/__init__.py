"""The thin Ray Serve layer: ``app.build_app(args)`` validates the typed args and binds the graph
(ingress, scheduler, optional assembler, managed engines, the embedded simulated fleet). Every rule
lives in :mod:`narwhal_serve`; these classes only host it.
"""
