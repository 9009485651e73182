"""Demo-only code: the distillation demo and its scripted experts, the black-box demo agent."""
