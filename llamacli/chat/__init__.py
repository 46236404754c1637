"""The chat format: template.py renders a conversation with the file's chat template (in the bounded sandbox of
template_sandbox.py, template_limits.py and template_watchdog.py); reasoning.py and harmony.py tell a reply's
reasoning from its answer (splitter.py: what the two splitters share). The conversation itself, over a loaded
model, is engine/chat_session.py."""
