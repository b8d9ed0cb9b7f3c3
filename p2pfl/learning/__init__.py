"""Learning: models and their ``g``/``h`` split (``models``), local training and evaluation
(``train``), datasets (``data``) and their partition over nodes (``partition``)."""
