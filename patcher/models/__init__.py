"""Architecture specs (one file per architecture); `patcher.registry` maps model types to them."""
