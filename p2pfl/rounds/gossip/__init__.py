"""The gossip protocol of decentralized methods: synchronous rounds
(``decentralized``) and the asynchronous mode (``asynchronous``, ``timing.mode: async``)."""
