"""The read-only dashboard (``swarmloco dashboard``, ``swarmloco status``). No torch.

- ``view``: the pure core: records read + time -> the JSON-able view everything renders;
- ``collector``: reads a swarm's records from the DHT, once or every few seconds;
- ``app``, ``metrics``, ``static/index.html``: the HTTP app, ``/metrics`` and the page;
- ``text``: the view as a terminal table;
- ``service``: what the two commands run.
"""
