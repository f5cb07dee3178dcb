"""Engine replicas on Ray Serve (``pensieve serve --data-parallel-size N``).

Ray Serve runs the HTTP proxy; an ingress deployment reads each request, computes its
conversation's routing key and calls the engine deployment, whose request router
(:mod:`.router`) sends it to the replica that holds the conversation. Each replica runs the
ordinary server app (:func:`pensieve.server.main.build_server`) in process (:mod:`.asgi`);
all of them share one conversation store, so a conversation continues on any replica.
"""
