"""The teacher's client side: talking to a teacher endpoint (ours, vLLM or a hosted API) and the
``teacher_gen`` stage built on it (``client``: the chat and score clients, the answer cache, the failure
report). Serving a model, the teacher or a student, is ``ars_opd.serving``: the bundled server and the
launchers that start it or vLLM as a subprocess; the client imports the launchers, never the server.
"""
