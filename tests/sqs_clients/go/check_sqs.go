// The AWS SDK for Go v2 (service/sqs, as Debian packages it: golang-github-aws-aws-sdk-go-v2-dev,
// a release that speaks SQS's query protocol) against an SQS endpoint: every call a producer and
// a consumer make, with the SDK's own checks on (it rejects a message whose body MD5 differs).
// Prints one JSON object for tests/sqs_clients/test_go_sdk.py to assert; exits 1 on an SDK error.
//
//	SQS_ENDPOINT=http://127.0.0.1:PORT QUEUE_PREFIX=go ./check_sqs
//
// MD5OfMessageAttributes is computed here with AWS's algorithm (sorted names; each name, type
// and value length-prefixed, a transport byte 1 for String/Number, 2 for Binary) and compared
// with what the server answered.
package main

import (
	"context"
	"crypto/md5"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

var ctx = context.Background()

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func attributesMd5(attrs map[string]types.MessageAttributeValue) string {
	names := make([]string, 0, len(attrs))
	for n := range attrs {
		names = append(names, n)
	}
	sort.Strings(names)
	h := md5.New()
	field := func(b []byte) {
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(b)))
		h.Write(n[:])
		h.Write(b)
	}
	for _, n := range names {
		a := attrs[n]
		field([]byte(n))
		field([]byte(aws.ToString(a.DataType)))
		if a.BinaryValue != nil {
			h.Write([]byte{2})
			field(a.BinaryValue)
		} else {
			h.Write([]byte{1})
			field([]byte(aws.ToString(a.StringValue)))
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

func md5Hex(s string) string {
	sum := md5.Sum([]byte(s))
	return hex.EncodeToString(sum[:])
}

func str(v string) types.MessageAttributeValue {
	return types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
}

// One attribute of each type, custom types included, and a body outside ASCII.
var attrs = map[string]types.MessageAttributeValue{
	"Greeting": str("héllo wörld ✓"),
	"Count":    {DataType: aws.String("Number"), StringValue: aws.String("-12.5e3")},
	"Blob":     {DataType: aws.String("Binary"), BinaryValue: []byte{0, 1, 2, 253, 254, 255}},
	"Kind":     {DataType: aws.String("String.order"), StringValue: aws.String("express")},
	"Weight":   {DataType: aws.String("Number.int"), StringValue: aws.String("42")},
	"Thumb":    {DataType: aws.String("Binary.png"), BinaryValue: []byte{137, 80, 78, 71}},
}

const body = "first ✓ message: ünïcödé and <xml> & \"quotes\""

type obj = map[string]interface{}

func must[T any](v T, err error) T {
	if err != nil {
		fmt.Fprintf(os.Stderr, "%T: %v\n", err, err)
		os.Exit(1)
	}
	return v
}

func plain(a map[string]types.MessageAttributeValue) obj {
	out := obj{}
	for k, v := range a {
		e := obj{"DataType": aws.ToString(v.DataType)}
		if v.BinaryValue != nil {
			e["BinaryValue"] = v.BinaryValue // JSON: base64
		} else {
			e["StringValue"] = aws.ToString(v.StringValue)
		}
		out[k] = e
	}
	return out
}

func receiveAll(c *sqs.Client, url string, want int) []types.Message {
	var got []types.Message
	deadline := time.Now().Add(20 * time.Second)
	for len(got) < want && time.Now().Before(deadline) {
		r := must(c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1, VisibilityTimeout: 30,
			MessageAttributeNames: []string{"All"}, AttributeNames: []types.QueueAttributeName{"All"}}))
		got = append(got, r.Messages...)
	}
	return got
}

func standard(c *sqs.Client, prefix string) obj {
	out := obj{}
	url := aws.ToString(must(c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(prefix + "-std")})).QueueUrl)
	out["queue_url"] = url
	out["get_queue_url"] = aws.ToString(must(c.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{
		QueueName: aws.String(prefix + "-std")})).QueueUrl)

	sent := must(c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(body),
		MessageAttributes: attrs}))
	out["send"] = obj{"md5_body_ok": aws.ToString(sent.MD5OfMessageBody) == md5Hex(body),
		"md5_attrs_ok": aws.ToString(sent.MD5OfMessageAttributes) == attributesMd5(attrs),
		"message_id": aws.ToString(sent.MessageId)}

	var entries []types.SendMessageBatchRequestEntry
	byID := map[string]map[string]types.MessageAttributeValue{}
	for i := 0; i < 10; i++ {
		a := map[string]types.MessageAttributeValue{
			"Index": {DataType: aws.String("Number"), StringValue: aws.String(fmt.Sprint(i))}}
		id := fmt.Sprintf("e%d", i)
		byID[id] = a
		entries = append(entries, types.SendMessageBatchRequestEntry{Id: aws.String(id),
			MessageBody: aws.String(fmt.Sprintf("batch %d", i)), MessageAttributes: a})
	}
	batch := must(c.SendMessageBatch(ctx, &sqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries}))
	ok, ids := true, []string{}
	for _, s := range batch.Successful {
		ids = append(ids, aws.ToString(s.Id))
		ok = ok && aws.ToString(s.MD5OfMessageAttributes) == attributesMd5(byID[aws.ToString(s.Id)])
	}
	sort.Strings(ids)
	out["send_batch"] = obj{"successful": ids, "failed": len(batch.Failed), "md5_attrs_ok": ok}

	received := receiveAll(c, url, 11)
	var rec []obj
	var first types.Message
	for _, m := range received {
		rec = append(rec, obj{"body": aws.ToString(m.Body), "message_id": aws.ToString(m.MessageId),
			"attributes": plain(m.MessageAttributes), "system": m.Attributes,
			"md5_attrs_ok": len(m.MessageAttributes) == 0 || aws.ToString(m.MD5OfMessageAttributes) == attributesMd5(m.MessageAttributes)})
		if aws.ToString(m.Body) == body {
			first = m
		}
	}
	out["received"] = rec

	// Visibility: one message back at once (timeout 0), received again with a new handle.
	must(c.ChangeMessageVisibility(ctx, &sqs.ChangeMessageVisibilityInput{QueueUrl: aws.String(url),
		ReceiptHandle: first.ReceiptHandle, VisibilityTimeout: 0}))
	again := receiveAll(c, url, 1)
	var back []obj
	for _, m := range again {
		back = append(back, obj{"body": aws.ToString(m.Body), "receive_count": m.Attributes["ApproximateReceiveCount"],
			"new_handle": aws.ToString(m.ReceiptHandle) != aws.ToString(first.ReceiptHandle)})
	}
	out["after_visibility_0"] = back

	var dels []types.DeleteMessageBatchRequestEntry
	for i, m := range received {
		if aws.ToString(m.Body) != body {
			dels = append(dels, types.DeleteMessageBatchRequestEntry{Id: aws.String(fmt.Sprintf("d%d", i)),
				ReceiptHandle: m.ReceiptHandle})
		}
	}
	del := must(c.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: dels}))
	out["delete_batch"] = obj{"successful": len(del.Successful), "failed": len(del.Failed)}
	for _, m := range again {
		must(c.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle}))
	}
	qa := must(c.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: aws.String(url),
		AttributeNames: []types.QueueAttributeName{"All"}}))
	out["queue_attributes"] = qa.Attributes
	left := must(c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10,
		WaitTimeSeconds: 1}))
	out["left_after_delete"] = len(left.Messages)
	must(c.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(url)}))
	return out
}

func fifo(c *sqs.Client, prefix string) obj {
	out := obj{}
	url := aws.ToString(must(c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(prefix + "-order.fifo"),
		Attributes: map[string]string{"FifoQueue": "true", "ContentBasedDeduplication": "true"}})).QueueUrl)
	out["queue_url"] = url
	// Three groups, five messages each, sent interleaved: a0 b0 c0 a1 b1 c1 ...
	var sent []obj
	for i := 0; i < 5; i++ {
		for _, g := range []string{"a", "b", "c"} {
			b := fmt.Sprintf("%s%d", g, i)
			r := must(c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(b),
				MessageGroupId: aws.String(g)}))
			sent = append(sent, obj{"body": b, "group": g, "sequence": aws.ToString(r.SequenceNumber),
				"message_id": aws.ToString(r.MessageId)})
		}
	}
	out["sent"] = sent
	// A duplicate (content-based dedup) answers the first MessageId.
	dup := must(c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("a0"),
		MessageGroupId: aws.String("a")}))
	out["duplicate_message_id"] = aws.ToString(dup.MessageId)

	// Rounds: receive what is handed out, then (before deleting) ask once more: nothing of a
	// group whose message is in flight may come. Then delete the round and go on.
	rounds := []obj{}
	delivered := 0
	deadline := time.Now().Add(30 * time.Second)
	receive := func(wait int32) []types.Message {
		return must(c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10,
			WaitTimeSeconds: wait, VisibilityTimeout: 30,
			AttributeNames: []types.QueueAttributeName{"All"}})).Messages
	}
	describe := func(ms []types.Message) []obj {
		out := []obj{}
		for _, m := range ms {
			out = append(out, obj{"body": aws.ToString(m.Body), "group": m.Attributes["MessageGroupId"],
				"sequence": m.Attributes["SequenceNumber"]})
		}
		return out
	}
	for delivered < len(sent) && time.Now().Before(deadline) {
		msgs := receive(1)
		if len(msgs) == 0 {
			continue
		}
		extra := receive(0)
		rounds = append(rounds, obj{"received": describe(msgs), "while_in_flight": describe(extra)})
		all := append(msgs, extra...)
		delivered += len(all)
		var dels []types.DeleteMessageBatchRequestEntry
		for i, m := range all {
			dels = append(dels, types.DeleteMessageBatchRequestEntry{Id: aws.String(fmt.Sprintf("d%d", i)),
				ReceiptHandle: m.ReceiptHandle})
		}
		must(c.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: dels}))
	}
	out["rounds"] = rounds
	must(c.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(url)}))
	return out
}

// The largest message SQS allows: 1 MiB of UTF-8 (two bytes a character), its MD5 checked by the SDK both ways.
func largest(c *sqs.Client, prefix string) obj {
	url := aws.ToString(must(c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(prefix + "-big")})).QueueUrl)
	b := strings.Repeat("é", 512*1024)
	sent := must(c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(b)}))
	m := receiveAll(c, url, 1)[0]
	must(c.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle}))
	must(c.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(url)}))
	return obj{"body_bytes": len(b), "md5_sent": aws.ToString(sent.MD5OfMessageBody),
		"md5_received": aws.ToString(m.MD5OfBody), "same_body": aws.ToString(m.Body) == b}
}

func main() {
	endpoint := os.Getenv("SQS_ENDPOINT")
	prefix := env("QUEUE_PREFIX", "go")
	c := sqs.New(sqs.Options{
		Region:           "us-east-1",
		EndpointResolver: sqs.EndpointResolverFromURL(endpoint),
		Credentials: credentials.NewStaticCredentialsProvider(env("AWS_ACCESS_KEY_ID", "test"),
			env("AWS_SECRET_ACCESS_KEY", "test"), ""),
		RetryMaxAttempts: 1,
	})
	result := obj{"standard": standard(c, prefix), "fifo": fifo(c, prefix), "largest": largest(c, prefix)}
	if err := json.NewEncoder(os.Stdout).Encode(result); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
