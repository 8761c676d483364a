"""The HTTP face of the service: the FastAPI app (``main.create_app``), one router per
resource (``api``), RFC 9457 problem details and streamed uploads. It stands on the service
core (``zoopick.service``) and never imports the workers."""
