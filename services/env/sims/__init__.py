"""rlfabric's own simulated tasks, registered as gymnasium ids (so the gymnasium adapter, vector envs and action
chunks all apply). Their models are written in the repo: nothing is downloaded.

    rlfabric/ArmReach-v0       a planar arm reaches a red ball it sees in a top-down camera image
    rlfabric/ArmReachLang-v0   a red and a blue ball; an instruction ("reach the blue ball") says which one

Both take ``observation="pixels"`` (image + proprioception [+ instruction tokens]) or ``"state"`` (a vector with
the balls' positions [+ instruction tokens]: the same task without vision, for fast checks; in ArmReachLang the
goal is still named only by the instruction).
"""

from gymnasium.envs.registration import register

register("rlfabric/ArmReach-v0", entry_point="rlfabric.services.env.sims.arm_reach:ArmReach", max_episode_steps=40,
         kwargs={"colors": ("red",), "instruction": False})
register("rlfabric/ArmReachLang-v0", entry_point="rlfabric.services.env.sims.arm_reach:ArmReach", max_episode_steps=40,
         kwargs={"colors": ("red", "blue"), "instruction": True})
