"""Chat templates: choosing a model's template (templates.py), rendering Jinja ones in a sandbox (jinja.py) under a
time and size budget (budget.py), Ollama's Go subset (gotemplate.py), and the tool-call syntax a template implies
(tool_calls.py)."""
