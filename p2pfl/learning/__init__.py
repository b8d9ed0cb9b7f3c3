"""Learning, on the ground floor: states and their parts (``state``, ``layout``), models and
their ``g``/``h`` split (``models``, ``split_model``, ``user_model``), local training and
evaluation (``train``, ``dp_train``), datasets (``data``, ``readers``, ``own_data``, ...) and
their partition over nodes (``partition``), a trained model's files (``artifacts``), and
what a peer's state must pass and how states combine robustly (``admission``, ``robust``,
``defence``)."""
