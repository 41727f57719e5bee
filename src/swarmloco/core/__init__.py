"""The pure algorithmic core: no sockets, no asyncio, no environment variables.

Outer optimizer, int8 codec, schedules, fragment plans, the swarm manifest and id. Every
function here is a plain function of its inputs so that it can be tested on its own.
"""
