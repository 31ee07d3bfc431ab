"""On-policy distillation: prompts, the student's rollouts, and training samples built from them.

Stage after ``generation`` and ``data``, before ``training``: :mod:`.prompts` reads prompt
records and applies each tokenizer's chat template, :mod:`.samples` turns a rollout (prompt +
response) into the packed sample the runtime trains on (loss on the response only).
"""
