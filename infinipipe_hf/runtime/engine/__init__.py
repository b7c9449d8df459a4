"""The engine: builds the stage, plans steps and executes their actions."""
