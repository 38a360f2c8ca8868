package e2bfake

// The fake's own account of E2B's wire format, written from the
// specifications of e2b-dev/infra at commit 54693ff353d2 (spec/openapi.yml,
// packages/envd/spec/envd.yaml, packages/envd/spec/process/process.proto in
// the proto3 JSON mapping) and the Connect protocol
// (connectrpc.com/docs/protocol). It is kept apart from the provider's
// internal/providers/e2b/internal/wire on purpose: were the two to share types, a wrong
// JSON name would be wrong on both sides and every test would pass. Both
// are held to the golden bodies in internal/providers/e2b/testdata/golden instead.
//
// Request bodies are read into pointers where the specification requires
// a member, so that a missing one is told from a zero one and refused, as
// E2B's API (which validates requests against its specification) refuses
// it.

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"
)

// Headers and ports.
const (
	headerAPIKey      = "X-API-Key"      // components.securitySchemes.ApiKeyAuth
	headerNextToken   = "X-Next-Token"   // components.headers.XNextToken
	headerAccessToken = "X-Access-Token" // envd.yaml AccessTokenAuth
	// The sandbox proxy routes a request with these to a sandbox's port
	// (the SDKs' E2B_SANDBOX_URL mode).
	headerSandboxID   = "E2b-Sandbox-Id"
	headerSandboxPort = "E2b-Sandbox-Port"
	envdPort          = 49983 // where envd listens in every sandbox
)

// SandboxState values.
const (
	stateRunning = "running"
	statePaused  = "paused"
)

// apiError is components.schemas.Error, and envd's Error (which has code
// and message only).
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// newSandboxBody is NewSandbox, as the fake reads it.
type newSandboxBody struct {
	TemplateID *string           `json:"templateID"` // required
	Timeout    *int64            `json:"timeout"`    // seconds, minimum 0, default 15
	AutoPause  *bool             `json:"autoPause"`
	Secure     *bool             `json:"secure"`
	Metadata   map[string]string `json:"metadata"`
	EnvVars    map[string]string `json:"envVars"`
}

// timeoutBody is SandboxTimeoutRequest and ConnectSandbox: timeout is
// required.
type timeoutBody struct {
	Timeout *int64 `json:"timeout"`
}

// pauseBody is SandboxPauseRequest.
type pauseBody struct {
	Memory *bool `json:"memory"`
}

// snapshotBody is SandboxSnapshotRequest.
type snapshotBody struct {
	Name *string `json:"name"`
}

// sandboxJSON is Sandbox, the answer of create and connect.
type sandboxJSON struct {
	TemplateID      string `json:"templateID"`
	SandboxID       string `json:"sandboxID"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken,omitempty"`
}

// listedJSON is ListedSandbox, an item of GET /v2/sandboxes.
type listedJSON struct {
	TemplateID  string            `json:"templateID"`
	SandboxID   string            `json:"sandboxID"`
	ClientID    string            `json:"clientID"`
	StartedAt   time.Time         `json:"startedAt"`
	EndAt       time.Time         `json:"endAt"`
	CPUCount    int               `json:"cpuCount"`
	MemoryMB    int               `json:"memoryMB"`
	DiskSizeMB  int               `json:"diskSizeMB"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	State       string            `json:"state"`
	EnvdVersion string            `json:"envdVersion"`
}

// detailJSON is SandboxDetail: ListedSandbox's members and the access
// token.
type detailJSON struct {
	listedJSON
	EnvdAccessToken string `json:"envdAccessToken,omitempty"`
}

// snapshotJSON is SnapshotInfo.
type snapshotJSON struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// entryJSON is envd's EntryInfo, an item of POST /files's answer.
type entryJSON struct {
	Path string `json:"path"`
	Name string `json:"name"`
	Type string `json:"type"`
}

// The process service (process.proto) in the proto3 JSON mapping:
// lowerCamelCase names, default values left out, bytes as standard base64,
// enums by name.

type processConfigJSON struct {
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args"`
	Envs map[string]string `json:"envs"`
	Cwd  *string           `json:"cwd"`
}

type startRequestJSON struct {
	Process processConfigJSON `json:"process"`
	Tag     *string           `json:"tag"`
	Stdin   *bool             `json:"stdin"` // envd: true when absent
}

type startResponseJSON struct {
	Event processEventJSON `json:"event"`
}

// processEventJSON is ProcessEvent: one of its members is set.
type processEventJSON struct {
	Start *startEventJSON `json:"start,omitempty"`
	Data  *dataEventJSON  `json:"data,omitempty"`
	End   *endEventJSON   `json:"end,omitempty"`
}

type startEventJSON struct {
	PID uint32 `json:"pid,omitempty"`
}

type dataEventJSON struct {
	Stdout []byte `json:"stdout,omitempty"`
	Stderr []byte `json:"stderr,omitempty"`
}

// endEventJSON is ProcessEvent.EndEvent: exit_code is "exitCode" in JSON.
type endEventJSON struct {
	ExitCode int32  `json:"exitCode,omitempty"`
	Exited   bool   `json:"exited,omitempty"`
	Status   string `json:"status,omitempty"`
}

type selectorJSON struct {
	PID *uint32 `json:"pid"`
	Tag *string `json:"tag"`
}

type sendInputJSON struct {
	Process selectorJSON `json:"process"`
	Input   struct {
		Stdin []byte `json:"stdin"`
	} `json:"input"`
}

type closeStdinJSON struct {
	Process selectorJSON `json:"process"`
}

type sendSignalJSON struct {
	Process selectorJSON `json:"process"`
	Signal  signalJSON   `json:"signal"`
}

// signalJSON is process.Signal: by name, or (as proto3 JSON parsers also
// accept) by number.
type signalJSON string

func (s *signalJSON) UnmarshalJSON(b []byte) error {
	var name string
	if json.Unmarshal(b, &name) == nil {
		*s = signalJSON(name)
		return nil
	}
	var n int32
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("signal: neither an enum name nor a number: %s", b)
	}
	switch n {
	case 9:
		*s = "SIGNAL_SIGKILL"
	case 15:
		*s = "SIGNAL_SIGTERM"
	default:
		*s = signalJSON(strconv.Itoa(int(n)))
	}
	return nil
}

// The Connect protocol.
const (
	streamContentType = "application/connect+json"
	unaryContentType  = "application/json"
	headerTimeout     = "Connect-Timeout-Ms"
	flagEndStream     = 0x02
	maxEnvelope       = 64 << 20
)

// connectErrorJSON is a Connect Error.
type connectErrorJSON struct {
	Code    string `json:"code"`
	Message string `json:"message,omitempty"`
}

// endStreamJSON is an EndStreamResponse: {} after a success.
type endStreamJSON struct {
	Error *connectErrorJSON `json:"error,omitempty"`
}

// connectStatus is the HTTP status of a unary call's error (the
// protocol's table of error codes).
func connectStatus(code string) int {
	switch code {
	case "canceled":
		return 499
	case "invalid_argument", "failed_precondition", "out_of_range":
		return 400
	case "deadline_exceeded":
		return 504
	case "not_found":
		return 404
	case "already_exists", "aborted":
		return 409
	case "permission_denied":
		return 403
	case "resource_exhausted":
		return 429
	case "unimplemented":
		return 501
	case "unavailable":
		return 503
	case "unauthenticated":
		return 401
	}
	return 500
}

// writeEnvelope writes a stream message: the flags, its length (4 bytes,
// big-endian) and the message's JSON.
func writeEnvelope(w io.Writer, flags byte, msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	out := make([]byte, 5, 5+len(b))
	out[0] = flags
	binary.BigEndian.PutUint32(out[1:], uint32(len(b)))
	_, err = w.Write(append(out, b...))
	return err
}

// readEnvelope reads one stream message.
func readEnvelope(r io.Reader) (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return 0, nil, errors.New("no message in the stream")
		}
		return 0, nil, fmt.Errorf("a message's envelope: %w", err)
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > maxEnvelope {
		return 0, nil, fmt.Errorf("a message of %d bytes, over %d", n, maxEnvelope)
	}
	msg := make([]byte, n)
	if _, err := io.ReadFull(r, msg); err != nil {
		return 0, nil, fmt.Errorf("a message cut short: %w", err)
	}
	return hdr[0], msg, nil
}
