"""Models the project did not write, built the way users build them, for tests that use them as users do.

Each factory is importable as ``tests.models.<module>:<callable>`` (``poet ... --model``) and returns what
``--model module:callable`` accepts. Nothing is downloaded: Hugging Face models come from their configs.
"""
