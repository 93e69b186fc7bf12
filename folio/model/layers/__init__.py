"""Building blocks of decoder-only transformers, shared by the model families in folio/model/."""
