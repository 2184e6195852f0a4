package nbd

// Wire constants of the NBD protocol (NetworkBlockDevice/nbd doc/proto.md).
// Only the transmission flags are exported: the kernel-attach layer hands
// them to the kernel, which does no handshake of its own.

const (
	magicInit           = 0x4e42444d41474943 // "NBDMAGIC"
	magicOpt            = 0x49484156454F5054 // "IHAVEOPT"
	magicOptReply       = 0x3e889045565a9
	magicRequest        = 0x25609513
	magicSimpleReply    = 0x67446698
	magicStructuredRepl = 0x668e33ef
)

// Handshake flags (server) and client flags.
const (
	hsFixedNewstyle = 1 << 0
	hsNoZeroes      = 1 << 1

	clientFixedNewstyle = 1 << 0
	clientNoZeroes      = 1 << 1
)

// Options.
const (
	optExportName       = 1
	optAbort            = 2
	optList             = 3
	optStartTLS         = 5
	optInfo             = 6
	optGo               = 7
	optStructuredReply  = 8
	optListMetaContext  = 9
	optSetMetaContext   = 10
	optExtendedHeaders  = 11
	repAck              = 1
	repServer           = 2
	repInfo             = 3
	repMetaContext      = 4
	repErrUnsup         = 1<<31 | 1
	repErrPolicy        = 1<<31 | 2
	repErrInvalid       = 1<<31 | 3
	repErrUnknown       = 1<<31 | 6
	repErrShutdown      = 1<<31 | 7
	repErrTooBig        = 1<<31 | 9
	infoExport          = 0
	infoName            = 1
	infoDescription     = 2
	infoBlockSize       = 3
	metaBaseAllocation  = "base:allocation"
	metaBaseAllocID     = 1
	maxOptionData       = 64 << 10 // larger options are refused with ERR_TOO_BIG
	maxDiscardOption    = 1 << 20  // beyond this we stop reading and hang up
	maxStringLen        = 4096     // spec: strings MUST be no longer
	handshakeHeaderSize = 16
)

// TransmissionFlags are the per-export flags sent at the end of the
// handshake (and given to the kernel through netlink SERVER_FLAGS).
type TransmissionFlags uint16

const (
	FlagHasFlags        TransmissionFlags = 1 << 0
	FlagReadOnly        TransmissionFlags = 1 << 1
	FlagSendFlush       TransmissionFlags = 1 << 2
	FlagSendFUA         TransmissionFlags = 1 << 3
	FlagRotational      TransmissionFlags = 1 << 4
	FlagSendTrim        TransmissionFlags = 1 << 5
	FlagSendWriteZeroes TransmissionFlags = 1 << 6
	FlagSendDF          TransmissionFlags = 1 << 7
	FlagCanMultiConn    TransmissionFlags = 1 << 8
	FlagSendCache       TransmissionFlags = 1 << 10
	FlagSendFastZero    TransmissionFlags = 1 << 11
)

// Commands (their values double as Op values).
const (
	cmdRead        = 0
	cmdWrite       = 1
	cmdDisc        = 2
	cmdFlush       = 3
	cmdTrim        = 4
	cmdCache       = 5
	cmdWriteZeroes = 6
	cmdBlockStatus = 7
)

// Command flags.
const (
	cmdFlagFUA      = 1 << 0
	cmdFlagNoHole   = 1 << 1
	cmdFlagDF       = 1 << 2
	cmdFlagReqOne   = 1 << 3
	cmdFlagFastZero = 1 << 4
)

// Structured replies.
const (
	replyFlagDone        = 1 << 0
	replyTypeNone        = 0
	replyTypeOffsetData  = 1
	replyTypeBlockStatus = 5
	replyTypeError       = 1<<15 | 1
)

const (
	requestHeaderSize    = 28
	simpleReplySize      = 16
	structuredHeaderSize = 20

	// MaxPayload is the largest READ or WRITE accepted (and advertised
	// as the maximum block size): 32 MiB, as the kernel and qemu use.
	MaxPayload = 32 << 20
	// PreferredBlockSize is advertised to clients that ask (NBD_INFO_BLOCK_SIZE).
	PreferredBlockSize = 4096
)

// NBD error codes: the protocol fixes these values whatever the host errno is.
const (
	errPerm      = 1
	errIO        = 5
	errNoMem     = 12
	errInval     = 22
	errNoSpc     = 28
	errOverflow  = 75
	errNotSup    = 95
	errShutdown  = 108
	StateHole    = 1 << 0 // base:allocation: extent is not allocated
	StateZero    = 1 << 1 // base:allocation: extent reads as zeroes
	maxExtentsRe = 1024   // cap on descriptors per BLOCK_STATUS reply
)
