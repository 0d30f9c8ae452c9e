"""The bottom of the house: the vocabulary every layer shares.

Plain data types (request profile, instance/site snapshots, decisions), the
deterministic tokenizer and chat template, prefix block hashing, the roofline of model x GPU
(`hardware` tables, `roofline.StepTimer`), the SSE/usage reading of an OpenAI stream
(`sse`), and the fleet file. Nothing here does I/O except `fleet_config.load_fleet_file`.
"""
