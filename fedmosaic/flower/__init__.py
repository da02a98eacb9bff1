"""Flower runtime for fedmosaic (optional extra ``fedmosaic[flower]``).

- :mod:`fedmosaic.flower.codec`: any ``Payload`` <-> Flower ``RecordDict`` (no pickle)
- :mod:`fedmosaic.flower.transport`: the round loop's ``Transport`` over a Flower ``Grid``
- :mod:`fedmosaic.flower.app`: ``server_app`` / ``client_app`` components
- :mod:`fedmosaic.flower.project`: writes a ready Flower app (``fedmosaic flower app``)
- :mod:`fedmosaic.flower.local`: an in-process Grid (parity tests, overhead benchmark)
- :mod:`fedmosaic.flower.simulation`: Flower's Ray simulation runtime (``fedmosaic flower simulate``)
- :mod:`fedmosaic.flower.node`: a SuperNode with one long-running ClientApp process

Nothing outside this package imports ``flwr``.
"""
