"""The ``models`` stage: the built-in tokenizer and tiny models, and pinning of pretrained ones."""
