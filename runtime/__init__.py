"""Reference runtime on torch.distributed (the measure issue). Only this package imports torch."""
