"""Structured outputs: grammars (JSON schema, regex, choice, EBNF / Lark) that constrain what a request samples.

``params`` (the user's request, pure Python), ``backend`` (one interface over xgrammar and llguidance),
``manager`` (beside the scheduler: compile cache, matcher per request, one bitmask per step) and ``bitmask``
(the sampler's first stage). Importing this package loads no grammar library and no torch.
"""
