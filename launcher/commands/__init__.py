"""The command line's verbs over the launcher's parts: check and up (with resume), status, logs and down, ls, rm and prune, fetch, and the path arguments they take."""
