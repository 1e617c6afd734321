"""Per-provider toolchains: the Python environment a provider's workers run in.

A provider table may say ``toolchain = { requirements = [...] }`` (epbuild makes and keeps
the environment, ``toolchains.create``) or ``toolchain = { python = "..." }`` (the user's
interpreter). Its packages' versions go into the provider's action keys, read from its
``*.dist-info`` without starting it (``providers.base.scanning``), and its workers start with
``toolchains.boot.boot_command``. ``Toolchains`` resolves each spec once per command.
"""
