"""Whisper's fixed numbers: the 30 s window, its frames and positions, timestamp steps."""

SAMPLE_RATE = 16000  # Hz: every waveform Whisper takes
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE  # 480000
HOP_LENGTH = 160  # samples per log-mel frame
WINDOW_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000 log-mel frames
INPUT_STRIDE = 2  # log-mel frames per encoder position (the second convolution's stride)
FRAME_SECONDS = 0.01  # seconds per log-mel frame (HOP_LENGTH / SAMPLE_RATE)
TIME_PRECISION = 0.02  # seconds per timestamp token step (INPUT_STRIDE frames)
TASKS = ("transcribe", "translate")
