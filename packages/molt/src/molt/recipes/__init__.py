"""Recipes that ship with molt: agent modules usable as `--agent.module molt.recipes.NAME`."""
