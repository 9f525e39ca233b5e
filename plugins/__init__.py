"""Built-in dynbatchd plugins.

Installed as the package ``dynbatchd_plugins`` and registered through the
``dynbatchd`` entry-point group, exactly like a third-party plugin would be.
Each module implements only its own hooks.
"""
