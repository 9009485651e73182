"""AgentFlow: rollouts and orchestration (wire types, chat format, engines, agents, the store, the controller, CLI)."""
