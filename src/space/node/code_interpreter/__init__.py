"""The code-interpreter template (ADR 0058): its build spec (`spec`) and the kernel bridge it carries
(`kernel_bridge`, a standalone program run inside the sandbox: nothing of SPACE imports it as a module
except to read its source and test its pure functions)."""
