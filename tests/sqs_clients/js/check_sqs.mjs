// The AWS SDK for JavaScript v3 against an SQS endpoint: every call a producer and a consumer
// make, with the SDK's own checks on (it rejects a body whose MD5 differs). Prints one JSON
// object for tests/sqs_clients/test_js_sdk.py to assert; exits non-zero on an SDK error.
//
//   SQS_ENDPOINT=http://127.0.0.1:PORT QUEUE_PREFIX=p node check_sqs.mjs
//
// The SDK checks MD5OfBody/MD5OfMessageBody only; MD5OfMessageAttributes is computed here with
// AWS's algorithm (sorted names; each name, type and value length-prefixed, a transport byte
// 1 for String/Number, 2 for Binary) and compared with what the server answered.
import { createHash } from "node:crypto";
import {
  SQSClient, CreateQueueCommand, GetQueueUrlCommand, GetQueueAttributesCommand, SendMessageCommand,
  SendMessageBatchCommand, ReceiveMessageCommand, ChangeMessageVisibilityCommand,
  DeleteMessageCommand, DeleteMessageBatchCommand, DeleteQueueCommand,
} from "@aws-sdk/client-sqs";

const endpoint = process.env.SQS_ENDPOINT;
const prefix = process.env.QUEUE_PREFIX || "js";
const client = new SQSClient({
  endpoint, region: "us-east-1", maxAttempts: 1,
  credentials: { accessKeyId: process.env.AWS_ACCESS_KEY_ID || "test",
                 secretAccessKey: process.env.AWS_SECRET_ACCESS_KEY || "test" },
});

function attributesMd5(attrs) {
  const parts = [];
  const field = (bytes) => {
    const len = Buffer.alloc(4);
    len.writeUInt32BE(bytes.length);
    parts.push(len, bytes);
  };
  for (const name of Object.keys(attrs).sort()) {
    const a = attrs[name];
    field(Buffer.from(name, "utf8"));
    field(Buffer.from(a.DataType, "utf8"));
    if (a.BinaryValue !== undefined) {
      parts.push(Buffer.from([2]));
      field(Buffer.from(a.BinaryValue));
    } else {
      parts.push(Buffer.from([1]));
      field(Buffer.from(a.StringValue, "utf8"));
    }
  }
  return createHash("md5").update(Buffer.concat(parts)).digest("hex");
}

const md5 = (s) => createHash("md5").update(Buffer.from(s, "utf8")).digest("hex");
const plain = (attrs) => Object.fromEntries(Object.entries(attrs || {}).map(([k, a]) => [k, {
  DataType: a.DataType,
  ...(a.BinaryValue !== undefined ? { BinaryValue: Buffer.from(a.BinaryValue).toString("base64") }
                                  : { StringValue: a.StringValue }),
}]));

// One attribute of each type, custom types included, and a body outside ASCII.
const ATTRS = {
  Greeting: { DataType: "String", StringValue: "héllo wörld ✓" },
  Count: { DataType: "Number", StringValue: "-12.5e3" },
  Blob: { DataType: "Binary", BinaryValue: new Uint8Array([0, 1, 2, 253, 254, 255]) },
  Kind: { DataType: "String.order", StringValue: "express" },
  Weight: { DataType: "Number.int", StringValue: "42" },
  Thumb: { DataType: "Binary.png", BinaryValue: new Uint8Array([137, 80, 78, 71]) },
};
const BODY = "first ✓ message: ünïcödé and <xml> & \"quotes\"";

async function receiveAll(QueueUrl, want, { visibility = 30 } = {}) {
  const got = [];
  const deadline = Date.now() + 20000;
  while (got.length < want && Date.now() < deadline) {
    const r = await client.send(new ReceiveMessageCommand({
      QueueUrl, MaxNumberOfMessages: 10, WaitTimeSeconds: 1, VisibilityTimeout: visibility,
      MessageAttributeNames: ["All"], MessageSystemAttributeNames: ["All"],
    }));
    got.push(...(r.Messages || []));
  }
  return got;
}

async function standard() {
  const out = {};
  const { QueueUrl } = await client.send(new CreateQueueCommand({ QueueName: `${prefix}-std` }));
  out.queue_url = QueueUrl;
  out.get_queue_url = (await client.send(new GetQueueUrlCommand({ QueueName: `${prefix}-std` }))).QueueUrl;

  const sent = await client.send(new SendMessageCommand({ QueueUrl, MessageBody: BODY, MessageAttributes: ATTRS }));
  out.send = { md5_body_ok: sent.MD5OfMessageBody === md5(BODY),
               md5_attrs_ok: sent.MD5OfMessageAttributes === attributesMd5(ATTRS), message_id: sent.MessageId };

  const entries = Array.from({ length: 10 }, (_, i) => ({
    Id: `e${i}`, MessageBody: `batch ${i}`,
    MessageAttributes: { Index: { DataType: "Number", StringValue: String(i) } },
  }));
  const batch = await client.send(new SendMessageBatchCommand({ QueueUrl, Entries: entries }));
  out.send_batch = {
    successful: (batch.Successful || []).map((s) => s.Id).sort(), failed: batch.Failed || [],
    md5_attrs_ok: (batch.Successful || []).every((s) => s.MD5OfMessageAttributes ===
      attributesMd5(entries.find((e) => e.Id === s.Id).MessageAttributes)),
  };

  const received = await receiveAll(QueueUrl, 11);
  out.received = received.map((m) => ({
    body: m.Body, message_id: m.MessageId, attributes: plain(m.MessageAttributes),
    md5_attrs_ok: m.MD5OfMessageAttributes === attributesMd5(m.MessageAttributes || {}),
    system: m.Attributes || {},
  }));

  // Visibility: one message back at once (timeout 0), received again with a new handle.
  const first = received.find((m) => m.Body === BODY);
  await client.send(new ChangeMessageVisibilityCommand({ QueueUrl, ReceiptHandle: first.ReceiptHandle,
                                                         VisibilityTimeout: 0 }));
  const again = await receiveAll(QueueUrl, 1);
  out.after_visibility_0 = again.map((m) => ({ body: m.Body, receive_count: m.Attributes?.ApproximateReceiveCount,
                                               new_handle: m.ReceiptHandle !== first.ReceiptHandle }));

  const rest = received.filter((m) => m !== first);
  const del = await client.send(new DeleteMessageBatchCommand({ QueueUrl, Entries: rest.map((m, i) => ({
    Id: `d${i}`, ReceiptHandle: m.ReceiptHandle })) }));
  out.delete_batch = { successful: (del.Successful || []).length, failed: del.Failed || [] };
  for (const m of again) {
    await client.send(new DeleteMessageCommand({ QueueUrl, ReceiptHandle: m.ReceiptHandle }));
  }
  const attrs = await client.send(new GetQueueAttributesCommand({ QueueUrl, AttributeNames: ["All"] }));
  out.queue_attributes = attrs.Attributes;
  const left = await client.send(new ReceiveMessageCommand({ QueueUrl, MaxNumberOfMessages: 10, WaitTimeSeconds: 1 }));
  out.left_after_delete = (left.Messages || []).length;
  await client.send(new DeleteQueueCommand({ QueueUrl }));
  return out;
}

async function fifo() {
  const out = {};
  const { QueueUrl } = await client.send(new CreateQueueCommand({
    QueueName: `${prefix}-order.fifo`,
    Attributes: { FifoQueue: "true", ContentBasedDeduplication: "true" } }));
  out.queue_url = QueueUrl;
  // Three groups, five messages each, sent interleaved: a0 b0 c0 a1 b1 c1 ...
  const sent = [];
  for (let i = 0; i < 5; i++) {
    for (const g of ["a", "b", "c"]) {
      const body = `${g}${i}`;
      const r = await client.send(new SendMessageCommand({ QueueUrl, MessageBody: body, MessageGroupId: g }));
      sent.push({ body, group: g, sequence: r.SequenceNumber, message_id: r.MessageId });
    }
  }
  out.sent = sent;
  // A duplicate (content-based dedup) answers the first MessageId.
  const dup = await client.send(new SendMessageCommand({ QueueUrl, MessageBody: "a0", MessageGroupId: "a" }));
  out.duplicate_message_id = dup.MessageId;

  // Rounds: receive what is handed out, then (before deleting) ask once more: nothing of a group
  // whose message is in flight may come. Then delete the round and go on.
  out.rounds = [];
  const deadline = Date.now() + 30000;
  let delivered = 0;
  while (delivered < sent.length && Date.now() < deadline) {
    const r = await client.send(new ReceiveMessageCommand({ QueueUrl, MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
      VisibilityTimeout: 30, MessageSystemAttributeNames: ["All"] }));
    const msgs = r.Messages || [];
    if (!msgs.length) continue;
    const probe = await client.send(new ReceiveMessageCommand({ QueueUrl, MaxNumberOfMessages: 10,
      VisibilityTimeout: 30, MessageSystemAttributeNames: ["All"] }));
    const extra = probe.Messages || [];
    out.rounds.push({
      received: msgs.map((m) => ({ body: m.Body, group: m.Attributes?.MessageGroupId,
                                   sequence: m.Attributes?.SequenceNumber })),
      while_in_flight: extra.map((m) => ({ body: m.Body, group: m.Attributes?.MessageGroupId })),
    });
    const all = [...msgs, ...extra];
    delivered += all.length;
    await client.send(new DeleteMessageBatchCommand({ QueueUrl, Entries: all.map((m, i) => ({
      Id: `d${i}`, ReceiptHandle: m.ReceiptHandle })) }));
  }
  await client.send(new DeleteQueueCommand({ QueueUrl }));
  return out;
}

// The largest message SQS allows: 1 MiB of UTF-8 (two bytes a character), its MD5 checked by the SDK both ways.
async function largest() {
  const { QueueUrl } = await client.send(new CreateQueueCommand({ QueueName: `${prefix}-big` }));
  const body = "é".repeat(512 * 1024);
  const sent = await client.send(new SendMessageCommand({ QueueUrl, MessageBody: body }));
  const [m] = await receiveAll(QueueUrl, 1);
  await client.send(new DeleteMessageCommand({ QueueUrl, ReceiptHandle: m.ReceiptHandle }));
  await client.send(new DeleteQueueCommand({ QueueUrl }));
  return { body_bytes: Buffer.byteLength(body, "utf8"), md5_sent: sent.MD5OfMessageBody, md5_received: m.MD5OfBody,
           same_body: m.Body === body };
}

try {
  const result = { standard: await standard(), fifo: await fifo(), largest: await largest() };
  process.stdout.write(JSON.stringify(result) + "\n");
} catch (err) {
  process.stderr.write(`${err.name}: ${err.message}\n${err.stack}\n`);
  process.exit(1);
}
