"""The deployment page's rollout: its state and steps (`deployment.html`), and pause / resume /
undo behind the confirmation page (`deployments.watch.RolloutControl`)."""

from __future__ import annotations

from typing import Final

from nexa.contracts.deployments import RolloutStatus
from nexa.contracts.domain import Actor
from nexa.control.deployments import Deployments

#: Console action → what it does to the rollout.
ROLLOUT_ACTIONS: Final = frozenset({"rollout_pause", "rollout_resume", "rollout_undo"})


def rollout_effect(status: RolloutStatus, action: str) -> str:
    """What the confirmation page says the action will do."""
    name = status.deployment
    if status.rollout is None:
        return f"Deployment {name} has no rollout in progress: this will be refused."
    if action == "rollout_pause":
        return f"No further replica of {name} is replaced until the rollout is resumed; its watch goes on."
    if action == "rollout_resume":
        return f"The rollout of {name} goes on: the next replica is replaced once the new ones have soaked."
    return (
        f"The rollout of {name} stops and its {status.new} changed replica(s) return to the last good spec, "
        "one at a time."
    )


async def rollout_act(deployments: Deployments, actor: Actor, name: str, action: str) -> str:
    """Do `action`; what the page says it did (a refusal is a typed error, shown as such)."""
    if action == "rollout_pause":
        await deployments.pause_rollout(actor, name)
        return f"The rollout of {name} is paused."
    if action == "rollout_resume":
        await deployments.resume_rollout(actor, name)
        return f"The rollout of {name} goes on."
    await deployments.undo_rollout(actor, name)
    return f"The rollout of {name} is undone: its changed replicas return to the last good spec."
