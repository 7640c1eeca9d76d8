"""Every error the SQS listener answers, as AWS answers it: one table.

Each name is the error's shape in AWS's API model (the JSON protocol's ``__type`` is
``com.amazonaws.sqs#<name>``); beside it the legacy query-protocol code (the query answer's
``<Code>`` and the JSON answer's ``x-amzn-query-error: <code>;Sender`` header, which botocore
reports as the error code) and the HTTP status, from the model and AWS's "Common Errors".
"""
from __future__ import annotations

from ..errors import SqsApiError

# name -> (legacy query code, HTTP status, sender's fault)
CODES: dict[str, tuple[str, int, bool]] = {
    # modeled errors of the SQS API
    "QueueDoesNotExist": ("AWS.SimpleQueueService.NonExistentQueue", 400, True),
    "QueueNameExists": ("QueueAlreadyExists", 400, True),
    "QueueDeletedRecently": ("AWS.SimpleQueueService.QueueDeletedRecently", 400, True),
    "BatchEntryIdsNotDistinct": ("AWS.SimpleQueueService.BatchEntryIdsNotDistinct", 400, True),
    "BatchRequestTooLong": ("AWS.SimpleQueueService.BatchRequestTooLong", 400, True),
    "EmptyBatchRequest": ("AWS.SimpleQueueService.EmptyBatchRequest", 400, True),
    "InvalidBatchEntryId": ("AWS.SimpleQueueService.InvalidBatchEntryId", 400, True),
    "TooManyEntriesInBatchRequest": ("AWS.SimpleQueueService.TooManyEntriesInBatchRequest", 400, True),
    "MessageNotInflight": ("AWS.SimpleQueueService.MessageNotInflight", 400, True),
    "PurgeQueueInProgress": ("AWS.SimpleQueueService.PurgeQueueInProgress", 403, True),
    "UnsupportedOperation": ("AWS.SimpleQueueService.UnsupportedOperation", 400, True),
    "ReceiptHandleIsInvalid": ("ReceiptHandleIsInvalid", 404, True),
    "InvalidAttributeName": ("InvalidAttributeName", 400, True),
    "InvalidAttributeValue": ("InvalidAttributeValue", 400, True),
    "InvalidIdFormat": ("InvalidIdFormat", 400, True),
    "InvalidMessageContents": ("InvalidMessageContents", 400, True),
    "InvalidSecurity": ("AWS.SimpleQueueService.InvalidSecurity", 403, True),
    "OverLimit": ("OverLimit", 403, True),
    "RequestThrottled": ("RequestThrottled", 403, True),
    "ResourceNotFoundException": ("ResourceNotFoundException", 404, True),
    # AWS's common errors
    "InvalidAction": ("InvalidAction", 400, True),
    "InvalidParameterValue": ("InvalidParameterValue", 400, True),
    "MissingParameter": ("MissingParameter", 400, True),
    "MalformedQueryString": ("MalformedQueryString", 400, True),
    "InvalidClientTokenId": ("InvalidClientTokenId", 403, True),
    "SignatureDoesNotMatch": ("SignatureDoesNotMatch", 403, True),
    "IncompleteSignature": ("IncompleteSignature", 400, True),
    "MissingAuthenticationToken": ("MissingAuthenticationToken", 403, True),
    "RequestExpired": ("RequestExpired", 400, True),
    "AccessDenied": ("AccessDenied", 403, True),
    "InternalFailure": ("InternalFailure", 500, False),
    "ServiceUnavailable": ("ServiceUnavailable", 503, False),
}


def fault(name: str, message: str) -> SqsApiError:
    """The error ``name`` (a key of :data:`CODES`) with ``message``."""
    query_code, status, sender = CODES[name]
    return SqsApiError(name, message, query_code, status, sender)


def invalid(message: str) -> SqsApiError:
    return fault("InvalidParameterValue", message)


def missing(name: str) -> SqsApiError:
    return fault("MissingParameter", f"The request must contain the parameter {name}.")


def no_queue() -> SqsApiError:
    return fault("QueueDoesNotExist", "The specified queue does not exist.")


def as_sqs(err: BaseException) -> SqsApiError:
    """The SQS error for an error of shardq's client (or the SqsApiError itself)."""
    from ..errors import (Closed, InvalidJob, LeaseLost, OutcomeUnknown, QueueFull, ShardUnavailable,
                          UnknownQueue)
    if isinstance(err, SqsApiError):
        return err
    if isinstance(err, InvalidJob):
        return invalid(f"One or more parameters are invalid. Reason: {err}")
    if isinstance(err, UnknownQueue):
        return fault("QueueDoesNotExist", f"The specified queue does not exist: {err}")
    if isinstance(err, QueueFull):
        return fault("OverLimit", f"The queue is full: {err}")
    if isinstance(err, LeaseLost):
        return fault("ReceiptHandleIsInvalid", f"The receipt handle is no longer valid: {err}")
    if isinstance(err, (ShardUnavailable, OutcomeUnknown, Closed)):
        return fault("ServiceUnavailable", f"The service is unavailable; try again: {err}")
    return fault("InternalFailure", f"The request processing has failed: {type(err).__name__}")
