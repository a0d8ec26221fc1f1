"""The ``subset`` stage and what renders data as text: synthetic tasks, dataset sources, row normalisation, prompts."""
