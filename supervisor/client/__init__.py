"""The runner side: a client of the control API and the operations built on it."""
