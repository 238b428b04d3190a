"""jaxpar: write a model once with logical axis names, run it under any parallelism layout."""
