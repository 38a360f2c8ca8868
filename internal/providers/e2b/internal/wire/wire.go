// Package wire owns the subset of E2B's wire formats that the provider
// (internal/providers/e2b) speaks: the REST API's request and response bodies, the
// envd file API's error body, and the envd process service's messages in
// the Connect protocol's JSON encoding with its stream envelopes. The fake
// (internal/providers/e2b/e2bfake) does not use it: it has its own account of the
// format, and both are held to the golden bodies in
// internal/providers/e2b/testdata/golden, so a mistake here cannot be agreed with.
//
// The types are written by hand from the specifications in the e2b-dev/infra
// repository at commit SpecCommit: spec/openapi.yml (REST API, info.version
// 0.1.0), packages/envd/spec/envd.yaml (envd 0.1.3: /files) and
// packages/envd/spec/process/process.proto (the process service). Only the
// fields stasis reads or writes are here; JSON names follow the OpenAPI
// schemas and, for the protobuf messages, the proto3 JSON mapping
// (lowerCamelCase names, bytes as standard base64, enums by name).
package wire

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// SpecCommit is the e2b-dev/infra commit whose specifications these types
// follow.
const SpecCommit = "54693ff353d26c5fe1951db5467e751f3e2f984e"

// REST API headers.
const (
	APIKeyHeader    = "X-API-Key"    // securitySchemes.ApiKeyAuth
	NextTokenHeader = "X-Next-Token" // components.headers.XNextToken
)

// envd addressing: the port envd listens on in every sandbox, and the
// headers that route a request to a sandbox's port through one sandbox URL
// (the SDK's E2B_SANDBOX_URL mode), plus envd's access-token header.
const (
	EnvdPort          = 49983
	SandboxIDHeader   = "E2b-Sandbox-Id"
	SandboxPortHeader = "E2b-Sandbox-Port"
	AccessTokenHeader = "X-Access-Token"
)

// Sandbox states (components.schemas.SandboxState).
const (
	StateRunning = "running"
	StatePaused  = "paused"
)

// Error is components.schemas.Error, the body of every REST error answer
// (and, with a plain code, of envd's /files errors).
type Error struct {
	Code      int32  `json:"code"`
	ErrorCode string `json:"error_code,omitempty"`
	Message   string `json:"message"`
}

// NewSandbox is the body of POST /sandboxes.
type NewSandbox struct {
	TemplateID string `json:"templateID"`
	// Timeout is the time to live in seconds (default 15).
	Timeout   *int32            `json:"timeout,omitempty"`
	AutoPause *bool             `json:"autoPause,omitempty"`
	Secure    *bool             `json:"secure,omitempty"`
	Metadata  map[string]string `json:"metadata,omitempty"`
	EnvVars   map[string]string `json:"envVars,omitempty"`
}

// Sandbox is what POST /sandboxes and POST /sandboxes/{id}/connect answer.
type Sandbox struct {
	TemplateID      string  `json:"templateID"`
	SandboxID       string  `json:"sandboxID"`
	Alias           string  `json:"alias,omitempty"`
	ClientID        string  `json:"clientID"`
	EnvdVersion     string  `json:"envdVersion"`
	EnvdAccessToken string  `json:"envdAccessToken,omitempty"`
	Domain          *string `json:"domain,omitempty"`
}

// SandboxDetail is what GET /sandboxes/{id} answers; ListedSandbox, an item
// of GET /v2/sandboxes, has the same fields but the token and the domain.
type SandboxDetail struct {
	TemplateID      string            `json:"templateID"`
	Alias           string            `json:"alias,omitempty"`
	SandboxID       string            `json:"sandboxID"`
	ClientID        string            `json:"clientID"`
	StartedAt       time.Time         `json:"startedAt"`
	EndAt           time.Time         `json:"endAt"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken,omitempty"`
	Domain          *string           `json:"domain,omitempty"`
	CPUCount        int32             `json:"cpuCount"`
	MemoryMB        int32             `json:"memoryMB"`
	DiskSizeMB      int32             `json:"diskSizeMB"`
	Metadata        map[string]string `json:"metadata,omitempty"`
	State           string            `json:"state"`
}

// ListedSandbox is one item of GET /v2/sandboxes.
type ListedSandbox = SandboxDetail

// Timeout is the body of POST /sandboxes/{id}/timeout (SandboxTimeoutRequest)
// and of POST /sandboxes/{id}/connect (ConnectSandbox): seconds from the
// time of the request.
type Timeout struct {
	Timeout int32 `json:"timeout"`
}

// PauseRequest is the body of POST /sandboxes/{id}/pause.
type PauseRequest struct {
	Memory *bool `json:"memory,omitempty"`
}

// SnapshotRequest is the body of POST /sandboxes/{id}/snapshots.
type SnapshotRequest struct {
	Name string `json:"name,omitempty"`
}

// SnapshotInfo is what POST /sandboxes/{id}/snapshots answers and what GET
// /snapshots lists. SnapshotID is a template id with its tag; a sandbox is
// made from the snapshot by creating one with that template id.
type SnapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// The envd process service (process.proto), served with the Connect
// protocol at /process.Process/<Method>.

// ProcessConfig is process.ProcessConfig.
type ProcessConfig struct {
	Cmd  string            `json:"cmd"`
	Args []string          `json:"args,omitempty"`
	Envs map[string]string `json:"envs,omitempty"`
	Cwd  *string           `json:"cwd,omitempty"`
}

// StartRequest is process.StartRequest.
type StartRequest struct {
	Process ProcessConfig `json:"process"`
	Tag     *string       `json:"tag,omitempty"`
	// Stdin opens the process's standard input for SendInput and
	// CloseStdin; envd defaults it to true when absent.
	Stdin *bool `json:"stdin,omitempty"`
}

// StartResponse is process.StartResponse, one message of Start's stream.
type StartResponse struct {
	Event ProcessEvent `json:"event"`
}

// ProcessEvent is process.ProcessEvent; exactly one field is set.
type ProcessEvent struct {
	Start     *StartEvent `json:"start,omitempty"`
	Data      *DataEvent  `json:"data,omitempty"`
	End       *EndEvent   `json:"end,omitempty"`
	Keepalive *struct{}   `json:"keepalive,omitempty"`
}

// StartEvent is ProcessEvent.StartEvent.
type StartEvent struct {
	PID uint32 `json:"pid,omitempty"`
}

// DataEvent is ProcessEvent.DataEvent (one of stdout, stderr, pty).
type DataEvent struct {
	Stdout []byte `json:"stdout,omitempty"`
	Stderr []byte `json:"stderr,omitempty"`
	Pty    []byte `json:"pty,omitempty"`
}

// EndEvent is ProcessEvent.EndEvent. envd fills it from Go's ProcessState:
// ExitCode is -1 and Exited false when a signal ended the process, and
// Status is ProcessState.String() ("exit status 7", "signal: killed").
type EndEvent struct {
	ExitCode int32   `json:"exitCode,omitempty"`
	Exited   bool    `json:"exited,omitempty"`
	Status   string  `json:"status,omitempty"`
	Error    *string `json:"error,omitempty"`
}

// ProcessSelector is process.ProcessSelector.
type ProcessSelector struct {
	PID *uint32 `json:"pid,omitempty"`
	Tag *string `json:"tag,omitempty"`
}

// SendInputRequest is process.SendInputRequest.
type SendInputRequest struct {
	Process ProcessSelector `json:"process"`
	Input   ProcessInput    `json:"input"`
}

// ProcessInput is process.ProcessInput.
type ProcessInput struct {
	Stdin []byte `json:"stdin,omitempty"`
}

// CloseStdinRequest is process.CloseStdinRequest.
type CloseStdinRequest struct {
	Process ProcessSelector `json:"process"`
}

// SendSignalRequest is process.SendSignalRequest; Signal is the enum's name.
type SendSignalRequest struct {
	Process ProcessSelector `json:"process"`
	Signal  string          `json:"signal"`
}

// process.Signal values, by name as the JSON mapping writes them.
const (
	SignalKill = "SIGNAL_SIGKILL"
	SignalTerm = "SIGNAL_SIGTERM"
)

// Connect protocol (connectrpc.com/docs/protocol): a streaming call's
// request and response bodies are sequences of envelopes, a flags byte and
// a big-endian 32-bit length before each message; the last response
// envelope carries FlagEndStream and an EndStream message. A unary call is
// a plain JSON body; its error is an HTTP status with a ConnectError body.
const (
	StreamContentType = "application/connect+json"
	UnaryContentType  = "application/json"
	ProtocolHeader    = "Connect-Protocol-Version"
	TimeoutHeader     = "Connect-Timeout-Ms"
	// KeepaliveHeader asks envd for keepalive events on a quiet stream
	// (seconds between them), as the SDK does.
	KeepaliveHeader = "Keepalive-Ping-Interval"
	FlagEndStream   = 0x02
	// MaxEnvelope bounds one message read from a stream.
	MaxEnvelope = 64 << 20
)

// ConnectError is a Connect error: Code is one of the protocol's codes
// ("not_found", "deadline_exceeded", ...).
type ConnectError struct {
	Code    string `json:"code"`
	Message string `json:"message,omitempty"`
}

// EndStream is the message of a stream's last envelope.
type EndStream struct {
	Error    *ConnectError       `json:"error,omitempty"`
	Metadata map[string][]string `json:"metadata,omitempty"`
}

// CodeHTTPStatus maps a Connect code to the HTTP status of a unary error
// answer, as the protocol specifies.
func CodeHTTPStatus(code string) int {
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

// WriteEnvelope writes one envelope holding msg encoded as JSON.
func WriteEnvelope(w io.Writer, flags byte, msg any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	hdr := make([]byte, 5, 5+len(b))
	hdr[0] = flags
	binary.BigEndian.PutUint32(hdr[1:], uint32(len(b)))
	_, err = w.Write(append(hdr, b...))
	return err
}

// ReadEnvelope reads one envelope. io.EOF means the stream ended cleanly
// between envelopes.
func ReadEnvelope(r io.Reader) (flags byte, msg []byte, err error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, nil, fmt.Errorf("stream cut inside an envelope header: %w", err)
		}
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > MaxEnvelope {
		return 0, nil, fmt.Errorf("stream envelope of %d bytes exceeds the %d-byte limit", n, MaxEnvelope)
	}
	msg = make([]byte, n)
	if _, err := io.ReadFull(r, msg); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, fmt.Errorf("stream cut inside an envelope: %w", err)
	}
	return hdr[0], msg, nil
}
