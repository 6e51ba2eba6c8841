"""What the tests share: test data (``factories``), the calls they make (``calls``), real chat
templates and tokenizers built offline (``chat_templates``, ``templates/``), engine stand-ins
(``loopback_engine``, ``engine_records``), slime's types (``slime_stub/``) and where things are
(``paths``). Tests import from here, never from ``buffer.demo``."""
